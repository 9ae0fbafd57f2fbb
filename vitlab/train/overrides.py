"""Changing a ``TrainConfig`` by field name: ``with_changes`` and the ``--set`` language.

    with_changes(cfg, {"optim.lr": 0.01, "model.width": 256})
    apply_overrides(cfg, ["optim.lr=0.01", "model.width=256", "lr=0.01"])

A name is ``section.field``, ``recipe``, or a flat name of earlier versions
(``LEGACY_NAMES``); ``model.<ViTConfig or ResNetConfig field>`` changes one field of the
architecture (``model.overrides``).  The changed sections are built anew, so they check
themselves, all changes together.

It lives in ``train/`` rather than ``cli/``: the experiments (``vitlab/experiments/``),
the recipes and the trainer's own set-up change configs by name too, and they sit below the
command line in the import order (the CLI uses everything; nothing imports the CLI).
"""
from __future__ import annotations

import ast
import dataclasses
import difflib
import types
import typing
from typing import Any

from vitlab.config import ConfigError, ResNetConfig, ViTConfig, is_int
from vitlab.models.registry import canonical_name, get_config

from .architecture import model_architecture
from .config import FINETUNE_MODEL_FIELDS, SECTIONS, ModelConfig, TrainConfig, image_size_field
from .legacy import LEGACY_NAMES
from .schedules import scaled_warmup


def members(annotation: Any) -> tuple:
    """The types an annotation admits: a union's members (``Optional[str]``: str and NoneType), else itself."""
    union = typing.get_origin(annotation) in (typing.Union, types.UnionType)
    return typing.get_args(annotation) if union else (annotation,)


MODEL_FIELDS = {f.name for f in dataclasses.fields(ModelConfig)}
# every field's annotation as a type (the sections declare them as text), by "section.field"
FIELD_TYPES = {f"{name}.{f.name}": typing.get_type_hints(cls)[f.name]
               for name, cls in SECTIONS.items() for f in dataclasses.fields(cls)}
# the fields that take "auto" or a count (``int | str``, optional or not): the text "3" is the count
AUTO_OR_COUNT = {path for path, kind in FIELD_TYPES.items() if set(members(kind)) - {type(None)} == {int, str}}
# the fields that take "auto" or a bool (``bool | str``): any word but "auto" is read as a bool
AUTO_OR_BOOL = {path for path, kind in FIELD_TYPES.items() if set(members(kind)) == {bool, str}}
# the fields of a size in pixels: N or HxW, as every command's --img-size takes it
SIZE_FIELDS = {"model.img_size", "model.weights_img_size"}
# the architecture's fields, ``--set model.<field>=value``: a ViT's or a BiT ResNet's (their defaults give the type)
ARCHITECTURE_FIELDS = {f.name: f.default for cls in (ResNetConfig, ViTConfig) for f in dataclasses.fields(cls)}
# What a ViT recipe sets that a BiT ResNet has not: the value that leaves it out
VIT_ONLY_FIELDS = {("model", "pre_logits"): False, ("model", "patch_init"): "lecun", ("model", "attn_init"): "xavier",
                   ("model", "posemb_init"): "normal", ("data", "progressive_sizes"): ()}


def field_names() -> list[str]:
    """Every settable field as ``section.field`` (and ``recipe``)."""
    return ["recipe"] + [f"{name}.{f.name}" for name, cls in SECTIONS.items() for f in dataclasses.fields(cls)]


def resolve_name(name: str) -> str:
    """``section.field`` for a new or an old flat name (ConfigError for neither)."""
    names = field_names()
    if name in names:
        return name
    if name in LEGACY_NAMES:
        return LEGACY_NAMES[name]
    close = difflib.get_close_matches(name, names + list(LEGACY_NAMES), n=3)
    hint = f" Did you mean {', '.join(close)}?" if close else ""
    raise ConfigError(f"unknown field {name!r}.{hint} Fields: {', '.join(names)}")


def named_fields(assignments: list[str] | tuple[str, ...]) -> set[str]:
    """The ``section.field`` each ``field=value`` of ``assignments`` (``--set``) names, old flat
    names resolved: what a command that sets some fields itself checks them against.  A name that
    is no field is left to ``parse_overrides`` to refuse."""
    names = set()
    for item in assignments:
        name = item.split("=", 1)[0].strip()
        try:
            names.add(resolve_name(name))
        except ConfigError:  # an architecture field (model.width) or a misspelling
            names.add(name)
    return names


def field_value(cfg: TrainConfig, name: str) -> Any:
    """The value of ``section.field`` (or an old flat name)."""
    path = resolve_name(name)
    if path == "recipe":
        return cfg.recipe
    section, key = path.split(".", 1)
    return getattr(getattr(cfg, section), key)


def with_changes(cfg: TrainConfig, changes: dict[str, Any]) -> TrainConfig:
    """``cfg`` with ``{"section.field": value}`` changed (old flat names accepted); the new
    sections check themselves.

    ``"model.<ViTConfig or ResNetConfig field>": value`` changes one field of the
    architecture (``model.overrides``).  A ``model.name`` of another model family (a BiT
    ResNet in a ViT recipe) leaves out what the recipe set for its own family and the new
    one has not (``fit_model_family``); what ``changes`` sets explicitly is kept, and
    refused when the model has no such field.  A shorter ``optim.steps`` without
    ``optim.warmup`` scales a warm-up given in steps (``schedules.scaled_warmup``), and a
    ``data.val_data`` without ``data.val_split`` holds nothing out of the training set.
    What ``changes`` sets also wins over the recipe's settings for a kind of device
    (``run.on_device``), field by field: they are the recipe's, a change is its user's
    (``explicit_over_device``).  A padding or a RandAugment magnitude changed to a value of none of
    the recipe's forms, that no form reads, is refused (``TrainConfig.check_augment_changes_read``).
    """
    # the errors were "'list' object has no attribute 'items'" and "'int' object has no attribute 'startswith'"
    if not isinstance(changes, dict) or not all(isinstance(name, str) for name in changes):
        raise ConfigError(f"changes={changes!r:.80}: expected a dict of {{'section.field': value}}, such as "
                          "{'optim.steps': 100}")
    by_section: dict[str, dict] = {}
    architecture: dict[str, Any] = {}
    recipe = cfg.recipe
    for name, value in changes.items():
        key = name[len("model."):] if name.startswith("model.") else None
        if key is not None and key not in MODEL_FIELDS and key in ARCHITECTURE_FIELDS:
            architecture[key] = value
            continue
        path = resolve_name(name)
        if path == "recipe":
            recipe = value
            continue
        section, key = path.split(".", 1)
        by_section.setdefault(section, {})[key] = value
    overridden = "overrides" in by_section.get("model", {})  # the whole dict given: the name is the base of those
    named = "name" in by_section.get("model", {})
    by_section = fit_model_family(cfg, by_section)
    if architecture and by_section.get("model", {}).get("init", cfg.model.init) is not None:
        # a fine-tune builds its init's architecture with only the regularisation changed (build._fine_tuned):
        # --set model.width=64 was recorded in the config and the model kept its init's width
        fixed = [key for key in architecture if key not in FINETUNE_MODEL_FIELDS]
        if fixed:
            raise ConfigError(f"model.{fixed[0]}={architecture[fixed[0]]!r}: the architecture of a fine-tuned model is "
                              f"its init's (model.init); of its fields only {', '.join(FINETUNE_MODEL_FIELDS)} apply")
    data = by_section.get("data", {})
    if data.get("val_data") and "val_split" not in data:  # a named validation set replaces the recipe's held-out split
        by_section["data"] = {**data, "val_split": 0}
    optim = by_section.get("optim", {})
    if "warmup" not in optim and is_int(optim.get("steps")) and optim["steps"] >= 1:  # a shorter run, same shape
        by_section["optim"] = {**optim, "warmup": scaled_warmup(cfg.optim.warmup, optim["steps"], cfg.optim.steps)}
    if cfg.run.on_device and "on_device" not in by_section.get("run", {}):
        on_device = explicit_over_device(cfg.run.on_device, by_section, architecture)
        if on_device != cfg.run.on_device:
            by_section.setdefault("run", {})["on_device"] = on_device
    if architecture:
        model = by_section.setdefault("model", {})
        model["overrides"] = {**model.get("overrides", cfg.model.overrides), **architecture}
    sections = {name: dataclasses.replace(getattr(cfg, name), **values) for name, values in by_section.items()}
    changed = dataclasses.replace(cfg, recipe=recipe, **sections)
    changed.check_augment_changes_read(cfg, by_section.get("augment", {}))
    changed.check_eval_changes_read(cfg, by_section.get("run", {}))
    if not overridden:
        check_named_model(cfg.model, changed.model, named)
    return changed


def check_named_model(before: ModelConfig, after: ModelConfig, named: bool = False) -> None:
    """Refuse a ``model.name`` that changes nothing: a recipe whose ``model.overrides`` set every
    field of its model that the named one differs in (the demo's and cifar10_scratch's set the
    whole shape) trained the recipe's model under the new name (--model ViT-B/16 trained the
    demo's ViT-demo/4, width 64, and recorded ViT-B/16).  Fields changed by name with it are the
    caller's own choice of model and are not compared: the recipe's overrides are.  ``named``: the
    name was given, and where it is the recipe's own, refused as ``check_own_name`` says."""
    if after.init is not None:
        return
    if canonical_name(after.name) == canonical_name(before.name):
        if named:
            check_own_name(before, after)
        return
    try:
        recipes = dataclasses.replace(after, overrides=before.overrides)
        named, own = (model_architecture(m) for m in (recipes, dataclasses.replace(recipes, name=before.name)))
    except ConfigError:  # one of the two does not take the recipe's overrides: the name does change the model
        return
    if dataclasses.replace(named, name=None) == dataclasses.replace(own, name=None):
        shown = f"{own.name!r}, " if own.name else ""
        raise ConfigError(f"model.name={after.name!r}: the recipe's model.overrides ({', '.join(before.overrides)}) "
                          f"set every field it differs from {before.name!r} in, so the run would train the recipe's "
                          f"model ({shown}width {getattr(own, 'width', '-')}, depth {getattr(own, 'depth', '-')}) "
                          f"under this name; --set 'model.overrides={{}}' trains {after.name} as registered, --set "
                          f"model.<field>=value changes the recipe's")


def check_own_name(before: ModelConfig, after: ModelConfig) -> None:
    """Refuse a ``model.name`` given as the recipe's own where the recipe's ``model.overrides`` make another model
    of it: the demo's base is ViT-Ti/16 and its overrides ViT-demo/4, so --model ViT-Ti/16 trained ViT-demo/4
    (width 64) as --model ViT-B/16 did before ``check_named_model``.  The overrides that leave it the named model
    (a regularisation, the resolution) and the fields changed by name with it (the caller's) are not compared."""
    caller = {key for key in after.overrides if after.overrides[key] != before.overrides.get(key)}
    try:
        registered = get_config(after.name)
        own = model_architecture(after)
    except ConfigError:  # the run's resolution names what is wrong with it
        return
    shadowing = [key for key, value in before.overrides.items() if key not in caller
                 and key not in (*FINETUNE_MODEL_FIELDS, "img_size") and getattr(registered, key, value) != value]
    if shadowing:
        shown = f"{own.name!r}, " if own.name else ""
        raise ConfigError(f"model.name={after.name!r}: the recipe's model.overrides ({', '.join(shadowing)}) make "
                          f"another model of it, so the run would train the recipe's model ({shown}width "
                          f"{getattr(own, 'width', '-')}, depth {getattr(own, 'depth', '-')}), not {after.name}; --set "
                          f"'model.overrides={{}}' trains {after.name} as registered; leave model.name out for the "
                          "recipe's")


def explicit_over_device(on_device: dict, by_section: dict[str, dict], architecture: dict) -> dict:
    """A recipe's settings per kind of device (``run.on_device``) less the fields changed now
    (``by_section``: {section: {field: value}}; ``architecture``: model fields), which would
    otherwise be set back to the recipe's values when the run resolves to that device: a
    ``--set augment.randaug_magnitude=9`` trained at the recipe's GPU magnitude on a GPU.  The
    changed model fields go into the device's own ``model.overrides`` (its larger model keeps
    the fields not changed); a change of ``model.overrides`` as a whole replaces them."""
    changed = {f"{section}.{key}" for section, values in by_section.items() for key in values}

    def overridden(name: str) -> bool:
        key = name[len("model."):] if name.startswith("model.") else None
        if key is not None and key not in MODEL_FIELDS and key in ARCHITECTURE_FIELDS:
            return key in architecture
        try:
            return resolve_name(name) in changed
        except ConfigError:  # not a field: the run's resolution names it when it applies the changes
            return False

    kept = {}
    for kind, changes in on_device.items():
        kept[kind] = {name: value for name, value in changes.items() if not overridden(name)}
        if architecture and isinstance(kept[kind].get("model.overrides"), dict):
            kept[kind]["model.overrides"] = {**kept[kind]["model.overrides"], **architecture}
    return kept


def model_family(name: str) -> type | None:
    """``ViTConfig`` or ``ResNetConfig``: the config class of a registry name (None: unknown)."""
    try:
        return type(get_config(name))
    except ConfigError:
        return None


def fit_model_family(cfg: TrainConfig, by_section: dict[str, dict]) -> dict[str, dict]:
    """``with_changes``' changes by section, plus what a change of model family leaves out.

    A recipe is written for one family (every recipe here: the ViT).  When ``model.name``
    changes to another (``--model BiT-R50x1``), the recipe's architecture overrides that
    the new family has no field for (dropout, patch size, a hybrid's ``resnet``, a
    ``name``) and its ViT-only options (``VIT_ONLY_FIELDS``: the pre-logits layer, the
    ViT's initialisations, progressive resizing) are left out, unless ``by_section`` sets
    them: a value set explicitly is kept, and refused by the checks if the family has no
    such field.  Masked patch prediction (``model.mpp``) is the purpose of its recipe, not
    an option of it: it stays, and is refused for a ResNet.
    """
    model = by_section.get("model", {})
    new, old = model_family(model.get("name", cfg.model.name)), model_family(cfg.model.name)
    if new is None or old is None or new is old:
        return by_section
    by_section = {section: dict(values) for section, values in by_section.items()}
    model = by_section.setdefault("model", {})
    if "overrides" not in model:
        fields = {f.name for f in dataclasses.fields(new)} - {"name"}  # the recipe's name is its own model's
        model["overrides"] = {k: v for k, v in cfg.model.overrides.items() if k in fields}
    if new is ResNetConfig:
        for (section, key), off in VIT_ONLY_FIELDS.items():
            if key not in by_section.get(section, {}) and getattr(getattr(cfg, section), key) != off:
                by_section.setdefault(section, {})[key] = off
    return by_section


# ----------------------------------------------------------------------------- the --set language


def parse_value(text: str, default: Any) -> Any:
    """Turn command-line text into a value of the default's type."""
    if isinstance(default, bool):
        low = text.strip().lower()
        if low in ("1", "true", "yes", "on"):
            return True
        if low in ("0", "false", "no", "off"):
            return False
        raise ValueError("expected true or false")
    if isinstance(default, str):
        return text.strip()
    if text.strip().lower() in ("none", "null"):
        return None
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        value = text  # a bare word: a string
    if isinstance(value, list):
        value = tuple(value)
    if isinstance(default, tuple):
        if isinstance(value, str):
            value = tuple(v.strip() for v in value.split(",") if v.strip())
        elif isinstance(value, (list, tuple)):
            value = tuple(value)
        else:
            value = (value,)
    elif isinstance(default, float) and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    return value


def example_of(path: str) -> Any:
    """A value of the type an optional field (default None) holds when set, for ``parse_value``:
    ``Optional[int]`` gives 0, ``Optional[str]`` ""."""
    if path in AUTO_OR_COUNT:  # a count is read before this; what is left is a word ("auto")
        return ""
    # not members' first: typing caches a union under any order of its members, so ``int | str``
    # can come back as ``str | int`` once another module has spelled it so
    kind = next(t for t in members(FIELD_TYPES[path]) if t is not type(None))
    return (typing.get_origin(kind) or kind)()


def parse_overrides(cfg: TrainConfig, assignments: list[str] | tuple[str, ...]) -> dict[str, Any]:
    """``section.field=value`` strings (old flat names too) as ``with_changes``' changes to
    ``cfg``; ``model.<ViTConfig or ResNetConfig field>=value`` changes the architecture
    (one entry of ``model.overrides``), ``model.overrides={}`` clears the recipe's.

    Values are Python literals (``0.1``, ``(0.9, 0.95)``, ``None``) or bare words
    (``cosine``); tuples also accept ``0.9,0.95``.  Nothing is checked but the names and
    the types: the changes are checked together, when ``with_changes`` builds the sections.
    """
    changes: dict[str, Any] = {}
    defaults = TrainConfig()
    for item in assignments:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: expected field=value")
        name, text = (s.strip() for s in item.split("=", 1))
        key = name[len("model."):] if name.startswith("model.") else None
        if key is not None and key not in MODEL_FIELDS:
            if key not in ARCHITECTURE_FIELDS:
                close = difflib.get_close_matches(key, sorted(MODEL_FIELDS) + list(ARCHITECTURE_FIELDS), n=3)
                hint = f" Did you mean {', '.join(f'model.{c}' for c in close)}?" if close else ""
                raise ConfigError(f"--set {name}: {key!r} is neither a model field nor a field of the architecture."
                                  f"{hint} Model fields: {', '.join(sorted(MODEL_FIELDS))}; ViTConfig's and "
                                  f"ResNetConfig's: {', '.join(ARCHITECTURE_FIELDS)}")
            # sizes: "16" and "16,16" both mean (16, 16), which the configs accept as an int or a pair
            default = None if key in ("img_size", "patch_size") else ARCHITECTURE_FIELDS[key]
            try:  # a bool's other word: the message named no field
                changes[f"model.{key}"] = parse_value(text, default)
            except ValueError as err:
                raise ConfigError(f"model.{key}={text!r}: {err}") from None
            continue
        path = resolve_name(name)
        if path == "model.overrides":
            value = parse_value(text, None)
            if not isinstance(value, dict):
                raise ConfigError(f"--set {name}={text!r}: expected a dict such as {{}} (no overrides) or "
                                  "{'width': 256}; or set the fields one by one, --set model.<field>=value")
            changes[path] = value
            continue
        default = field_value(defaults, path)
        if default is None:  # optional fields: "none" clears them
            if text.strip().lower() in ("none", "null"):
                changes[path] = None
                continue
            if path in SIZE_FIELDS:  # N or HxW, as --img-size reads it; model.img_size "auto" too
                auto = path == "model.img_size" and text.strip().lower() == "auto"
                changes[path] = "auto" if auto else image_size_field(text, path)
                continue
            default = example_of(path)
        if path in AUTO_OR_COUNT and text.strip().isdigit():
            changes[path] = int(text)
            continue
        if path in AUTO_OR_BOOL and text.strip().lower() != "auto":
            default = False
        try:
            changes[path] = parse_value(text, default)
        except ValueError as err:
            raise ConfigError(f"{path}={text!r}: {err}") from None
    return changes


def apply_overrides(cfg: TrainConfig, assignments: list[str] | tuple[str, ...]) -> TrainConfig:
    """``cfg`` with ``section.field=value`` strings applied (see ``parse_overrides``)."""
    return with_changes(cfg, parse_overrides(cfg, assignments))
