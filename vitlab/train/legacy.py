"""The names of earlier versions, and what they are called now.

``LEGACY_NAMES``: the flat field names of ``TrainConfig`` before it had sections.
Checkpoints and run folders written then hold a flat config dict (``{"lr": ..., "data":
...}``); ``from_dict`` reads it through ``nested_dict``, and so does ``recorded_section``
(what `eval` and `fewshot` read of a run), and ``--set lr=0.01`` still works through
``LEGACY_NAMES``.  The table is frozen: a new field gets no flat name.

``FORMER_SETTING_NAMES``: the experiments' settings (``vitlab.experiments``) before they
carried the trainer's names; recorded commands (``--set val=5000``) and ``results.json``
files written then hold them.  A table of its own: ``val`` or ``minutes`` is no field name
of the trainer's, and ``data`` means the data source in both (``data.source`` here).
"""
from __future__ import annotations

from typing import Any

LEGACY_NAMES = {
    "recipe": "recipe",
    "model": "model.name", "model_overrides": "model.overrides", "init": "model.init",
    "keep_pre_logits": "model.keep_pre_logits", "pre_logits": "model.pre_logits", "img_size": "model.img_size",
    "data": "data.source", "val_split": "data.val_split", "split_seed": "data.split_seed",
    "train_examples": "data.train_examples", "class_subset": "data.class_subset",
    "decode_workers": "data.decode_workers", "cache_dir": "data.cache_dir",
    "progressive_sizes": "data.progressive_sizes",
    **{name: f"augment.{name}" for name in (
        "crop", "crop_scale", "crop_pad", "flip", "alternate_flip", "randaug_ops", "randaug_magnitude",
        "mixup_alpha", "cutmix_alpha", "label_smoothing", "erase_prob")},
    **{name: f"optim.{name}" for name in (
        "optimizer", "lr", "lr_grid", "betas", "momentum", "weight_decay", "wd_scope", "batch_size", "accum_steps",
        "steps", "warmup", "decay", "min_lr", "clip_norm", "loss", "ema_decay")},
    **{name: f"run.{name}" for name in (
        "precision", "compile", "fsdp", "seed", "device", "threads", "retain_freed_memory", "time_limit",
        "time_measure_steps", "eval_every", "eval_batch_size", "eval_flip", "final_eval_shift", "log_every",
        "tensorboard", "ckpt_every", "keep_ckpts", "out")},
}

FORMER_SETTING_NAMES = {"val": "val_split", "minutes": "time_limit", "batch": "batch_size", "heads": "num_heads",
                        "mlp": "mlp_dim", "patch": "patch_size"}

# the sections the flat names were spread over ("model" was a flat name too: the model's name)
_SECTIONS = {path.split(".", 1)[0] for path in LEGACY_NAMES.values() if "." in path}


def is_flat(d: dict) -> bool:
    """Whether ``d`` is a config dict of the flat, pre-section layout."""
    return not any(isinstance(d.get(name), dict) for name in _SECTIONS)


def nested_dict(d: dict) -> dict:
    """A config dict in the sectioned layout, whichever layout ``d`` is in (no checks)."""
    if not is_flat(d):
        return d
    nested: dict = {}
    for name, value in d.items():
        path = LEGACY_NAMES.get(name, name)
        if "." in path:
            section, key = path.split(".", 1)
            nested.setdefault(section, {})[key] = value
        else:
            nested[path] = value
    return nested


def recorded_section(recorded: Any, name: str) -> dict:
    """Section ``name`` ("data", "optim", ...) of a config a run recorded (its ``config.json``,
    either layout, unchecked); {} where there is none."""
    return dict(nested_dict(recorded).get(name) or {}) if isinstance(recorded, dict) else {}
