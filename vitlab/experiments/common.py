"""What every experiment shares: its settings and the runs it trains through the trainer.

An experiment is a module of this package with

    TITLE, PAPER   one line each: what it asks and which figure/table of the paper it mirrors
    DEFAULT, QUICK plain dicts of settings (``Settings`` fields plus the experiment's own)
    OPTIONS        optional: the experiment's other settings and their defaults
    UNUSED         optional: {setting: what decides instead} for the settings its runs do not read
                   (or ``unused(values)`` giving it), so that a change to one is refused, not ignored
    run(settings, out) -> rows  trains/measures through the library, one row per (setting, seed)
    SUMMARY        the columns rows are grouped by; METRICS the columns averaged over seeds
                   (or ``metrics(rows)`` giving them, where the settings decide which there are)
    plot(table) -> Figure       optional: a figure of the aggregated table (``vitlab.analysis.plots``)
    notes(settings, rows) -> dict  optional: what results.json records beside the table (a measurement
                   the settings asked for that the runs could not make, and where)
    ARMS           optional: {list setting: the TrainConfig field (or fields, for a record such as
                   ["sgd", 0.1]) each of its values sets in its runs}, so that every value is checked
                   before the first run (``check_arms``), not when its runs start
    VERSION        optional: the measurement's version, raised when rows are no longer measured as
                   before, so that ``--resume`` takes none of an earlier version's from results.json

The settings carry the trainer's names (``batch_size``, ``num_heads``, ``mlp_dim``,
``patch_size``, ``val_split``, ``time_limit``: the ``TrainConfig`` and ``ViTConfig`` fields
they fill); ``vitlab.train.legacy.FORMER_SETTING_NAMES`` maps the names of earlier versions,
which recorded commands and ``results.json`` files hold.  The full-size forms train on the
data of ``vitlab.experiments.DATA_RECIPE`` (CIFAR-10); ``--data`` overrides it.

The runner (``vitlab.experiments.run_experiment``) writes ``out/results.json``,
``out/results.md`` (mean ± std over seeds), ``out/figure.png`` when matplotlib imports,
and ``out/section.md``: the findings section with the command, machine and wall time.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.nn.functional as F

from vitlab.analysis.cost import training_flops
from vitlab.config import ConfigError, need_int
from vitlab.data import load_in_memory, stratified_split
from vitlab.data.digits import load_digits_dataset
from vitlab.models.registry import build_model
from vitlab.train import train
from vitlab.train.loop import read_summary
from vitlab.train.resolve import recorded_paths, stated_model, trained_architecture, training_size
from vitlab.train.config import (AugmentConfig, DataConfig, ModelConfig, OptimConfig, RunConfig, TrainConfig,
                                 from_dict, to_dict)
from vitlab.train.optim import muon_step_flops
from vitlab.train.overrides import with_changes
from vitlab.weights import load_model

DIGITS = "digits"


@dataclass
class Settings:
    """The knobs every experiment has; ``extra`` holds the experiment's own.

    data:        "digits" (scikit-learn's 8x8 digits, upsampled) or a CIFAR-like ImageFolder archive.
    img_size:    training resolution.
    val_split:   held-out examples (class-stratified, split seed 0): 5,000 on CIFAR-10.
    steps:       optimiser steps per run (a ceiling when ``time_limit`` is set).
    time_limit:  minutes of wall time per run (0: none); the engine fits the schedule into it.
    batch_size, lr: the runs' batch and AdamW learning rate.
    width, depth, num_heads, mlp_dim, patch_size: the base ViT.
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
    val_split: int = 300
    steps: int = 20
    time_limit: float = 0.0
    batch_size: int = 64
    lr: float = 3e-3
    width: int = 32
    depth: int = 2
    num_heads: int = 2
    mlp_dim: int = 64
    patch_size: int = 4
    seeds: int = 1
    device: str = "auto"
    threads: int = 0
    resume: bool = False
    extra: dict = field(default_factory=dict)
    reused: list = field(default_factory=list)
    earlier_rows: tuple = ()

    INTERNAL = ("extra", "reused", "earlier_rows")

    def __post_init__(self) -> None:
        # the one setting no run's TrainConfig checks: 0 or fewer ran nothing and wrote an empty
        # table over the folder's results.md and results.json
        need_int("seeds", self.seeds, 1)

    @classmethod
    def names(cls) -> list[str]:
        """The settings every experiment has."""
        return [f.name for f in fields(cls) if f.name not in cls.INTERNAL]

    @classmethod
    def from_dict(cls, values: dict) -> "Settings":
        names = set(cls.names())
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
        d = {name: getattr(self, name) for name in self.names()}
        d.update(self.extra)
        return d


# ----------------------------------------------------------------------------- models


def vit_overrides(settings: Settings, **changes: Any) -> dict:
    """The base ViT of an experiment as ``ViTConfig`` overrides (changes win)."""
    d = dict(img_size=settings.img_size, patch_size=settings.patch_size, width=settings.width, depth=settings.depth,
             num_heads=settings.num_heads, mlp_dim=settings.mlp_dim, gelu="exact",
             name=f"ViT-w{settings.width}d{settings.depth}/{settings.patch_size}")
    d.update(changes)
    return d


def stem(settings: Settings, layers: Sequence[int] = (1,), width_factor: float | None = None) -> dict:
    """A small BiT-layout ResNet (BatchNorm) for the hybrid's stem / the ResNet baseline.

    Root 7x7/2 + max-pool /2, then ``layers`` units (each later stage /2): 16 px -> 4x4,
    32 px with (1, 3) -> 4x4, as the cifar10_scratch recipe's hybrid."""
    wf = width_factor if width_factor is not None else (0.5 if settings.digits else 1)
    return dict(layers=tuple(layers), width_factor=wf, img_size=settings.img_size, norm="batch")


def hybrid_overrides(settings: Settings, layers: Sequence[int] | None = None, **changes: Any) -> dict:
    layers = layers if layers is not None else ((1,) if settings.digits else (1, 3))
    return vit_overrides(settings, patch_size=1, resnet=stem(settings, layers),
                         name=f"R+ViT-w{settings.width}d{settings.depth}/1", **changes)


# ----------------------------------------------------------------------------- training


def train_config(settings: Settings, out: Path, seed: int, overrides: dict, changes: dict | None = None):
    """A ``TrainConfig`` for one run of an experiment: AdamW, cosine, pad-and-crop on CIFAR.

    Real data trains with ``precision="auto"``, as the recipes do (bf16 autocast where the CPU
    or GPU runs it faster than fp32, by the rule in ``vitlab.fast``), so a time-limited run
    gets the steps the hardware can give it; the digits of the quick forms train in fp32."""
    cfg = TrainConfig(
        recipe="experiment",
        model=ModelConfig(name="ViT-Ti/16", overrides=dict(overrides)),
        data=DataConfig(source=settings.data, val_split=settings.val_split, split_seed=0),
        augment=AugmentConfig(crop="none" if settings.digits else "pad", flip=not settings.digits),
        optim=OptimConfig(optimizer="adam", lr=settings.lr, weight_decay=0.05, batch_size=settings.batch_size,
                          steps=settings.steps, warmup=0.05 if settings.steps >= 20 else 1, decay="cosine",
                          clip_norm=1.0),
        run=RunConfig(precision="fp32" if settings.digits else "auto", eval_every=0,
                      log_every=max(1, settings.steps // 10), ckpt_every=0, keep_ckpts=1,
                      threads=settings.threads, device=settings.device, seed=seed, time_limit=settings.time_limit,
                      tensorboard=False, fast=not settings.digits, out=str(out)),
    )
    return with_changes(cfg, changes or {})


def check_arms(name: str, settings: Settings, arms: dict) -> None:
    """Every value of the list settings ``arms`` names, checked as the field of a run's ``TrainConfig`` it
    sets (``lrs``: ``optim.lr``), before the first run: a value its trainer refuses, such as lrs=[0.001, -1],
    was refused only when its runs started, after the runs of the values before it had trained.  Where
    the settings' own ViT is refused, no value can be told from it (optimiser's runs train a ResNet)."""
    overrides = vit_overrides(settings)
    try:
        train_config(settings, Path("."), 0, overrides)
    except ConfigError:
        return
    for key, names in arms.items():
        names = names if isinstance(names, tuple) else (names,)
        for value in settings.get(key) or ():
            items = tuple(value) if len(names) > 1 else (value,)
            try:
                train_config(settings, Path("."), 0, overrides, dict(zip(names, items)))
            except ConfigError as err:
                raise ConfigError(f"experiment {name}: {key}={settings.get(key)!r}: {value!r} is refused as a run's "
                                  f"{' and '.join(names)}: {err}") from None


def train_vit(settings: Settings, out: Path, seed: int, overrides: dict, changes: dict | None = None) -> dict:
    """Train one ViT (or hybrid) through ``vitlab.train.train``; the summary plus its FLOPs."""
    cfg = train_config(settings, out, seed, overrides, changes)
    summary = finished_run(cfg) if settings.resume else None
    if summary is None:
        summary = train(cfg, verbose=False, overwrite=True)
    else:
        settings.reused.append(cfg.run.out)
    classes = len(json.loads((Path(cfg.run.out) / "classes.json").read_text()))  # a run writes it; older summaries name it not
    summary["train_eflops"] = run_eflops(cfg, summary["steps"], classes)
    return summary


def run_eflops(cfg: TrainConfig, steps: int, num_classes: int) -> float:
    """The training exaFLOPs of ``steps`` steps of a run of ``cfg`` whose data has ``num_classes``
    classes: ``training_flops`` of the model it trains (``trained_architecture``) at its resolution, plus
    its optimiser's matmuls.  A fine-tune's had been counted for the recipe's model, which it does
    not train (its init's architecture is), or left None where that model could not take its size."""
    model = trained_architecture(cfg, num_classes)
    return (training_flops(model, steps, cfg.optim.batch_size, img_size=training_size(cfg))
            + optimiser_flops_per_step(model, cfg.optim.optimizer) * steps / 1e18)


def optimiser_flops_per_step(model_cfg, optimizer: str) -> int:
    """The matmul FLOPs an optimiser step adds to the forward and backward passes: Muon's
    orthogonalisation of the blocks' matrices; 0 for AdamW and SGD, whose elementwise updates
    the paper's count (3 x forward) leaves out as well."""
    if optimizer != "muon":
        return 0
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
    def as_json(c) -> dict:
        return json.loads(json.dumps(to_dict(c)))

    out = Path(cfg.run.out)
    try:
        summary = read_summary(out)  # its weights in its folder, from whatever folder it was made in
        saved = from_dict(json.loads((out / "config.json").read_text()))
        saved = with_changes(saved, recorded_paths(saved))  # a run that recorded its paths as typed: in this folder
        # its folder is the one it is read from, however the command that made it spelt it (relative to its folder)
        saved = with_changes(saved, {"run.out": cfg.run.out})
        finished = (out / "summary.json").stat().st_mtime
        if not Path(summary["weights"]).is_file():
            return None
        if cfg.model.init is not None and Path(cfg.model.init).stat().st_mtime >= finished:
            return None
        asked = stated_model(cfg)  # as the run's config.json states it: the init's model, its resolution, its data
    except (OSError, ValueError, KeyError, TypeError, ConfigError):
        return None
    return summary if same_values(as_json(asked), as_json(saved)) else None


def same_values(asked, saved) -> bool:
    """Whether a saved config holds the values asked; one asked as "auto" matches the value
    the run resolved it to (``config.json`` states the resolved worker counts, for one)."""
    if isinstance(asked, dict) and isinstance(saved, dict):
        return asked.keys() == saved.keys() and all(same_values(asked[k], saved[k]) for k in asked)
    return asked == saved or asked == "auto"


def load_images(settings: Settings, size: int | None = None):
    """(images uint8 (N, 3, H, W), labels, classes) of the experiment's data at ``size``."""
    size = size or settings.img_size
    if settings.digits:
        d = load_digits_dataset(size)
    else:
        d = load_in_memory(settings.data)
        if d.images.shape[-1] != size:
            d.images = F.interpolate(d.images.float(), size=(size, size), mode="bilinear",
                                     antialias=True).round().clamp(0, 255).byte()
    return d.images, d.labels, d.classes


def split(settings: Settings, labels):
    """The engine's held-out split: ``stratified_split(labels, val, split_seed=0)``."""
    return stratified_split(labels, settings.val_split, 0)


def train_resnet(settings: Settings, out: Path, seed: int, resnet: dict, optimizer: str = "adam",
                 lr: float | None = None, train_examples: int = 0) -> dict:
    """Train a BiT-layout ResNet classifier through the same engine, data, split, augmentation
    and schedule as ``train_vit``: the paper's ResNet baselines (``resnet`` as ``stem`` builds it).
    SGD runs with momentum 0.9 and L2 weight decay 5e-4, the CIFAR ResNet standard."""
    layers = "x".join(str(n) for n in resnet.get("layers", ()))
    default_lr = settings.lr if optimizer == "adam" else 0.1
    changes = {"model.name": "BiT-R50x1", "model.overrides": dict(resnet, name=f"BiT-R[{layers}]"),
               "optim.optimizer": optimizer, "optim.lr": lr if lr is not None else default_lr,
               "data.train_examples": int(train_examples)}
    if optimizer == "sgd":
        changes.update({"optim.weight_decay": 5e-4, "optim.wd_scope": "all"})
    return train_vit(settings, out, seed, {}, changes)


def load_trained(summary: dict):
    """The model a ``train_vit``/``train_resnet`` run saved."""
    return load_model(summary["weights"])
