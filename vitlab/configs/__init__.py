"""The training recipes: plain Python modules of this package, each with a
``get_config(**options) -> TrainConfig`` (big_vision style).

    load_recipe("paper_finetune:dataset=cifar100")   # a recipe of this package, with its options
    load_recipe("my/recipe.py:lr=0.01")              # a recipe file of one's own
    load_recipe("paper_pretrain", model_name="ViT-L/16")   # Table 3's row of that model
    load_recipe("paper_pretrain", changes={"model.init": "vit_l32.safetensors", ...})  # the init's row

A recipe whose settings depend on the model (the paper's pre-training, Table 3: a rate and
epochs per model) takes a ``model_name`` option; ``--model`` passes it.  With ``changes`` the
recipe is the run's config: a fine-tune's init named there, without a model, picks its own
model's row as the commands' ``--init`` does (changed afterwards by ``with_changes``, the
recipe's default model's row stays).

The recipes ship inside the package, so every install has them; ``vitlab train --recipe``
reads its argument with ``load_recipe``.
"""
from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
from pathlib import Path
from types import ModuleType

from vitlab.config import ConfigError
from vitlab.models.registry import canonical_name
from vitlab.train.config import TrainConfig


def recipes_dir() -> Path:
    """This package's folder: where the named recipes are."""
    return Path(__file__).resolve().parent


def list_recipes() -> list[str]:
    return sorted(p.stem for p in recipes_dir().glob("*.py") if not p.stem.startswith("_"))


def recipe_module(name: str) -> ModuleType:
    """A named recipe's module (imported), or a ``.py`` file's (loaded from its path)."""
    if not name.endswith(".py"):
        if name not in list_recipes():
            raise ConfigError(f"recipe={name!r}: no such recipe; known: {', '.join(list_recipes())} "
                              "(or a path to a .py file)")
        return importlib.import_module(f"{__name__}.{name}")
    path = Path(name).expanduser()
    if not path.is_file():
        raise ConfigError(f"recipe={name!r}: no such recipe file; known recipes: {', '.join(list_recipes())}")
    spec = importlib.util.spec_from_file_location(f"vitlab_recipe_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_recipe(spec: str, model_name: str | None = None, changes: dict | None = None) -> TrainConfig:
    """``NAME`` or ``path/to/file.py``, optionally ``:key=value,key=value`` passed to its
    ``get_config`` as strings (e.g. ``paper_finetune:dataset=cifar100``).  ``model_name``
    (the run's ``--model``, or its init's model) goes to a ``get_config`` that takes it, ahead of the spec's.

    changes: ``{"section.field": value}`` made to the recipe's config (``with_changes``), as the
        commands make their flags' and ``--set``'s; the model they name (``model.name``, else
        ``model_name``) picks a per-model recipe's row, and with a fine-tune's ``model.init`` must
        be the init's (``check_named_init``); naming none, the init's model does (its registry
        name, read from the file: ``resolve.init_model_name``), which ``train`` and ``finetune``
        take the same way."""
    if changes is not None:
        return recipe_with_changes(spec, model_name, changes)
    if isinstance(spec, os.PathLike):  # a recipe file's Path
        spec = os.fspath(spec)
    if not isinstance(spec, str):  # its .partition failed as an AttributeError
        raise ConfigError(f"recipe={spec!r:.80}: expected a recipe's name or a path to a .py file, as a string")
    name, _, arg_text = spec.partition(":")
    module = recipe_module(name)
    if not callable(getattr(module, "get_config", None)):
        raise ConfigError(f"recipe {name!r}: defines no get_config() returning a TrainConfig")
    parameters = inspect.signature(module.get_config).parameters
    options = [key for key, p in parameters.items() if p.kind is not inspect.Parameter.VAR_POSITIONAL]
    takes = f"{name} takes {', '.join(options) or 'no options'}"
    kwargs = {}
    for item in filter(None, arg_text.split(",")):
        key, equals, value = (part.strip() for part in item.partition("="))
        # "model" alone had been the option with the value "", and an option given twice took its last value
        if not equals or not key:
            raise ConfigError(f"recipe {spec!r}: {item!r} is not key=value; {takes}")
        if key in kwargs:
            raise ConfigError(f"recipe {spec!r}: option {key!r} given twice")
        kwargs[key] = value
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    unknown = [key for key in kwargs if key not in parameters and not takes_any]
    if unknown:
        raise ConfigError(f"recipe {spec!r}: unknown option {unknown[0]!r}; {takes}")
    if model_name is not None and "model_name" in parameters:
        named = kwargs.get("model_name")
        if named is not None and canonical_name(named) != canonical_name(model_name):  # one was dropped unsaid
            raise ConfigError(f"recipe {spec!r}: model_name={named!r}, and the run's model is {model_name!r} "
                              "(--model, or a fine-tune's init); name the model once")
        kwargs["model_name"] = model_name
    try:
        cfg = module.get_config(**kwargs)
    except (TypeError, ValueError) as err:  # an unknown or bad recipe argument
        if isinstance(err, ConfigError):
            raise
        raise ConfigError(f"recipe {spec!r}: {err}") from None
    if not isinstance(cfg, TrainConfig):
        raise ConfigError(f"recipe {spec!r}: get_config() returned {type(cfg).__name__}, not TrainConfig")
    return cfg


def recipe_with_changes(spec: str, model_name: str | None, changes: dict) -> TrainConfig:
    """``load_recipe(spec, model_name, changes)``: the recipe of the model named, else of the init's."""
    from vitlab.train.overrides import with_changes
    from vitlab.train.resolve import check_named_init, init_model_name

    named = changes.get("model.name") if isinstance(changes, dict) and changes.get("model.name") else model_name
    cfg = with_changes(load_recipe(spec, model_name=named), changes)  # with_changes refuses changes of another form
    if cfg.model.init is not None and named:  # named, not the recipe's default
        check_named_init(cfg, cfg.model.name)
    elif name := init_model_name(cfg):  # not named: a recipe whose rates are per model takes the init's row
        cfg = with_changes(load_recipe(spec, model_name=name), changes)
    return cfg
