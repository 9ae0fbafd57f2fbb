"""What a training checkpoint holds, and how a run continues from one bit-exactly.

``training_state`` gathers the model, optimiser, EMA, data-stream position, RNG states,
metric records and the run's clock; ``restore_state`` puts them back.  Under FSDP both are
collective calls (every rank takes part) and the full, unsharded state lives on rank 0.
"""
from __future__ import annotations

import hashlib
import random

import numpy as np
import torch
from torch import nn

from vitlab.config import ConfigError
from vitlab.data.labelled import same_data, same_spelling
from vitlab.data.splits import split_changes
from vitlab.models.registry import build_model

from .config import FINETUNE_MODEL_FIELDS, TrainConfig, from_dict, to_dict
from .distributed import all_gather_objects
from .inputs import class_difference
from .optim import set_lr_scales
from .overrides import field_value, with_changes

# torch.distributed.checkpoint is imported inside the FSDP paths below: it loads a large part of
# torch.distributed (FSDP with it), which a single-process run never needs

# fields that fix the data order, the model or the optimiser state, and the validation set (another
# data.val_data scored the rest of the run's curves on other images): a resumed run must keep them
# (model.pre_logits, model.keep_pre_logits and model.mpp build another model, whose checkpoint did not load;
# model.weights_img_size reads the init as another grid, and a run at the init's size trains at another)
RESUME_INVARIANTS = ("model.name", "model.overrides", "model.img_size", "model.init", "model.weights_img_size",
                     "model.pre_logits", "model.keep_pre_logits", "model.mpp", "data.source",
                     "data.val_split", "data.val_data", "data.split_seed", "data.train_examples", "data.class_subset",
                     "optim.batch_size", "optim.accum_steps", "optim.optimizer", "run.seed")
# fields whose values the checkpoint's optimiser state (torch's param_groups) and weight average bring
# back with it, over the command line's: by optimiser, the ones it reads (SGD has no betas); not Muon's
# optim.muon_adamw_lr, whose lr scale restore_state sets again from the run's config
RESTORED_WITH_STATE = ("optim.weight_decay", "optim.wd_scope", "optim.ema_decay")
RESTORED_BY_OPTIMIZER = {"adam": ("optim.betas",), "sgd": ("optim.momentum",),
                         "muon": ("optim.betas", "optim.muon_momentum")}


# how torch's optimisers run, which they hold among their groups' settings and load with them: this run's
# own (``optim.fusable``: torch's fused SGD has no form for FSDP's sharded parameters, and a checkpoint of a
# run without FSDP brought fused=True into one with it, whose first step failed)
IMPLEMENTATION = ("fused", "foreach")


def rank_seed(seed: int, rank: int, step: int = 0) -> int:
    """The seed of rank ``rank``'s torch stream once the model is built (dropout, the steps' draws):
    rank 0 keeps ``seed``'s stream, another rank a stream of its own (from ``step`` on, where it is
    resumed without its own saved).  Seeded alike, every rank drew the same dropout masks for its
    own examples: example i of each rank was masked the same way."""
    if rank == 0:
        return seed
    digest = hashlib.sha256(f"vitlab rank stream {seed} {rank} {step}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1  # torch.manual_seed takes up to 2**63 - 1 here


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def process_state() -> dict:
    """What a run changes in its process: the thread count and the random generators."""
    return {"threads": torch.get_num_threads(), "rng": rng_state()}


def set_process_state(state: dict) -> None:
    torch.set_num_threads(state["threads"])
    set_rng_state(state["rng"])


def check_same_run(cfg: TrainConfig, saved: dict) -> None:
    """Refuse to continue a checkpoint whose run differs in a ``RESUME_INVARIANTS`` field
    (``saved``: its config dict, sectioned or of the old flat layout)."""
    if not saved:
        return
    before = from_dict(saved)
    # another spelling of the same: ./d, its absolute path, a link (a run recorded its paths as typed before
    # ``resolve.recorded_paths``: those name a path in the working folder)
    for name in ("data.source", "data.val_data", "model.init"):
        if same_data(field_value(cfg, name), field_value(before, name)):
            before = with_changes(before, {name: field_value(cfg, name)})
    # a fine-tune's architecture is its init's, named by model.init (and by its own model name
    # only in checkpoints of this version); of its overrides the regularisation applies, and a checkpoint
    # written before a fine-tune recorded those alone holds the recipe's architecture overrides besides
    compared = [n for n in RESUME_INVARIANTS if not (n == "model.name" and cfg.model.init and before.model.init)]
    if cfg.model.init and before.model.init:
        applied = {k: v for k, v in before.model.overrides.items() if k in FINETUNE_MODEL_FIELDS}
        before = with_changes(before, {"model.overrides": applied})
    differences = _differences(cfg, before, compared)
    if differences:
        raise ConfigError(f"--resume: {differences} differ from the checkpoint's run; an exact continuation needs "
                          "the same values")
    # the optimiser's load_state_dict sets each group's weight decay, betas, momentum and lr scale back
    # to the checkpoint's, and the EMA its decay: another value was accepted and never used (wd_scope
    # regroups the parameters, which the saved groups no longer match; Muon's lr scale restore_state sets
    # again, so another optim.lr or optim.muon_adamw_lr takes effect and is not refused)
    differences = _differences(cfg, before, RESTORED_WITH_STATE + RESTORED_BY_OPTIMIZER.get(cfg.optim.optimizer, ()))
    if differences:
        raise ConfigError(f"--resume: {differences}: the checkpoint's optimiser state and weight average carry its "
                          "values, which a resumed run keeps; resume with those, or train on from its weights as a "
                          "new run (--init, another --out)")
    # without a time limit the schedule's length is the checkpoint's, and another optim.steps was
    # ignored without a word (a run asked for 12 steps stopped at its 6); with one, steps is a ceiling
    # and the budget plans again from the restart
    if not (cfg.run.time_limit or before.run.time_limit) and cfg.optim.steps != before.optim.steps:
        raise ConfigError(f"--resume: optim.steps={cfg.optim.steps} (checkpoint: {before.optim.steps}): a resumed run "
                          f"keeps its schedule, whose learning rate decays to step {before.optim.steps}; resume with "
                          "that number, or train on from its weights as a new run (--init, another --out)")


def training_fields(cfg: TrainConfig) -> list[str]:
    """The fields besides ``RESUME_INVARIANTS`` that decide how ``cfg``'s run trains: the model's other fields,
    the augmentation, the optimiser and its schedule, the input sizes and the arithmetic.  A resumed run may
    change them, from its resumption on (its config.json then records them)."""
    sections = to_dict(cfg)
    fields = [f"{section}.{name}" for section in ("model", "augment", "optim") for name in sections[section]]
    return [name for name in fields if name not in RESUME_INVARIANTS] + [
        "data.progressive_sizes", "run.precision", "run.loss_scale", "run.fp8"]


def check_finished_run_unchanged(cfg: TrainConfig, saved: dict, step: int, total_steps: int) -> None:
    """Refuse to resume a finished run (its checkpoint at step ``total_steps``) with other ``training_fields``
    than it trained with (``saved``: its config dict): nothing trains after its last step, and its config.json,
    written again, claimed the new settings for the weights it had trained.  Its length too: under a time limit
    (now or then) ``check_same_run`` takes optim.steps as a ceiling, and another one, or another time limit, trained
    no step more (the total is the checkpoint's), the records claiming it all the same.  A grid of rates is
    ``vitlab sweep``'s alone."""
    if not saved or step < total_steps:
        return
    names = [name for name in training_fields(cfg) if name != "optim.lr_grid"] + ["run.time_limit",
                                                                                  "run.time_measure_steps"]
    before = from_dict(saved)
    changed = _differences(cfg, before, names, whose="its run")
    if changed:
        raise ConfigError(f"--resume: the run in {cfg.run.out!r} had finished at step {step}; {changed} would train "
                          "nothing, and its records keep what trained it: resume with its settings, or train on from "
                          "its weights as a new run (--init, another --out)")


def check_same_classes(classes: list[str], saved) -> None:
    """Refuse to continue a checkpoint whose run trained on other classes than the data's now
    (``saved``: its class names; None in a checkpoint without them): a label is a class's place in
    the list, so a class folder added or renamed since trained the head's outputs on other classes'
    images without a word, or failed on the head's size with a traceback."""
    ours, theirs = same_spelling(list(classes)), same_spelling(list(saved or []))
    if saved is not None and ours != theirs:
        raise ConfigError(f"--resume: the data's classes are not the checkpoint's run's, "
                          f"{class_difference(ours, theirs)}; an exact continuation needs the same "
                          "classes (or train on from its weights as a new run: --init, another --out)")


def check_same_split(key, saved) -> None:
    """Refuse to continue a checkpoint whose run's split held other images than the data's split now
    (``key``, ``saved``: ``Splits.split_key``s; None in a checkpoint without one, which is held to its
    classes and, streamed, its counts alone): an image swapped for another, or shards packed again,
    keeps the counts, and the run's positions in the data then went on over other images, its
    curves scored on another held-out part."""
    changes = split_changes(key or {}, saved or {}, "the checkpoint's")
    if changes:
        raise ConfigError(f"--resume: the data changed since the checkpoint (now {'; '.join(changes)}); an exact "
                          "continuation needs the same images (or train on from its weights as a new run: --init, "
                          "another --out)")


def _differences(cfg: TrainConfig, before: TrainConfig, names, whose: str = "checkpoint") -> str:
    """The fields of ``names`` whose values differ, each with ``before``'s (``whose``): "" where none does."""
    return ", ".join(f"{k}={field_value(cfg, k)!r} ({whose}: {field_value(before, k)!r})"
                     for k in names if field_value(before, k) != field_value(cfg, k))


def sharded(setup) -> bool:
    return setup.cfg.run.fsdp and setup.world.size > 1


def _full(options_only: bool = False):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, cpu_offload=not options_only)


def model_state(setup) -> dict:
    """The full (unsharded) state dict of the model; with FSDP a collective call whose
    result is complete on rank 0 only."""
    if sharded(setup):
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return get_model_state_dict(setup.model, options=_full())
    return setup.model.state_dict()


def training_state(setup, step: int, total_steps: int, records: list[dict], clock: dict,
                   numerics: dict | None = None, window=None, planned_steps: int | None = None) -> dict:
    """Everything ``restore_state`` needs to continue bit-exactly (collective under FSDP).

    ``clock``: the run's wall time so far, its measured evaluation time and whether its
    schedule was fitted to the time limit yet (``TimeBudget.state``), so that a resumed
    time-limited run keeps counting, and fits a schedule it had not.
    ``numerics``: the counts of skipped and overflowed steps (``numerics.NonFinite``).
    ``window``: the ``loop.Window`` of the training numbers summed since the last metrics
    record, which the next record, after the restart, reports with its own steps'.
    ``planned_steps``: the schedule's length, where the time limit ended the run before it
    (``total_steps`` is then ``step``); None: ``total_steps``.
    """
    if sharded(setup):
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        optim_state = get_optimizer_state_dict(setup.model, setup.optimizer, options=_full())
    else:
        optim_state = setup.optimizer.state_dict()
    rng = rng_state()
    return {
        "step": step,
        "total_steps": total_steps,
        "planned_steps": total_steps if planned_steps is None else planned_steps,
        "config": to_dict(setup.cfg),
        "resolved": setup.resolved.record(),
        "model": model_state(setup),
        "optimizer": optim_state,
        "ema": setup.ema.state_dict() if setup.ema else None,
        "stream": setup.stream.state_dict(),
        "rng": rng,  # rank 0's, which a checkpoint of before "rng_ranks" held alone
        "rng_ranks": all_gather_objects(rng, setup.world),  # every rank's stream (dropout) its own
        "records": records,
        "classes": setup.splits.classes,
        "split_key": setup.splits.split_key,  # which images the run trains on and holds out (check_same_split)
        "clock": clock,
        "numerics": numerics or {},
        "window": window.state_dict(setup.world) if window is not None else None,
        "scaler": setup.scaler.state_dict() if setup.scaler is not None else None,  # fp16: the loss scale and its count
    }


def restore_state(setup, state: dict) -> tuple[int, int, list[dict]]:
    """Load a checkpoint into ``setup``; returns (step, total_steps, metric records)."""
    built = [{k: group[k] for k in IMPLEMENTATION if k in group} for group in setup.optimizer.param_groups]
    if sharded(setup):
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

        set_model_state_dict(setup.model, state["model"], options=_full(options_only=True))
        set_optimizer_state_dict(setup.model, setup.optimizer, keyed_by_name(state["optimizer"], setup),
                                 options=_full(options_only=True))
    else:
        setup.model.load_state_dict(state["model"])
        setup.optimizer.load_state_dict(state["optimizer"])
    for group, own in zip(setup.optimizer.param_groups, built):  # the saved groups bring the saving run's
        group.update(own)
    if setup.cfg.optim.optimizer == "muon":  # the saved groups' lr scale is that of the lr they were saved with
        set_lr_scales(setup.optimizer.param_groups, setup.cfg.optim)
    if setup.ema is not None and state.get("ema"):
        setup.ema.load_state_dict(state["ema"])
    if setup.scaler is not None and state.get("scaler"):
        setup.scaler.load_state_dict(state["scaler"])
    setup.stream.load_state_dict(state["stream"])
    restore_rank_rng(state, setup.world)
    return int(state["step"]), int(state["total_steps"]), list(state.get("records", []))


def restore_rank_rng(state: dict, world) -> None:
    """This rank's random state from a checkpoint: its own where the checkpoint holds every rank's
    for as many processes; else rank 0's (a checkpoint of another process count, or of before each
    rank's was kept), on another rank then moved to a stream of its own, as a new run's is."""
    ranks = state.get("rng_ranks")
    if ranks is not None and len(ranks) == world.size:
        set_rng_state(ranks[world.rank])
        return
    set_rng_state(state["rng"])
    if world.rank:  # seeded by the step too: not the stream this rank began the run with
        torch.manual_seed(rank_seed(int(state["config"]["run"]["seed"]), world.rank, int(state["step"])))


def keyed_by_name(optim_state: dict, setup) -> dict:
    """An optimiser's state dict with its parameters named, as FSDP's full state dicts name them: a
    checkpoint of a run without FSDP (one process, or DDP) numbers them in the order of its groups,
    which torch's FSDP loader does not read (a KeyError); the groups are the same (``build_optimizer``),
    so the numbers are this run's parameters in that order."""
    numbers = [i for group in optim_state["param_groups"] for i in group["params"]]
    if not all(isinstance(i, int) for i in numbers):
        return optim_state
    names = {id(p): name for name, p in setup.model.named_parameters()}
    name = dict(zip(numbers, (names[id(p)] for group in setup.optimizer.param_groups for p in group["params"])))
    return {"state": {name[i]: v for i, v in optim_state["state"].items()},
            "param_groups": [{**group, "params": [name[i] for i in group["params"]]}
                             for group in optim_state["param_groups"]]}


def final_model(setup) -> nn.Module | None:
    """The model to save: the EMA if on; under FSDP a fresh unsharded copy (rank 0 only).
    After masked patch prediction, the ViT inside it: what fine-tuning starts from."""
    if not sharded(setup):
        model = setup.ema.module if setup.ema else setup.model
        return model.vit if setup.cfg.model.mpp is not None else model
    state = model_state(setup)  # collective: every rank takes part
    if not setup.world.is_main:
        return None
    if setup.cfg.model.mpp is not None:
        state = {k[len("vit."):]: v for k, v in state.items() if k.startswith("vit.")}
    model = build_model(setup.model.cfg)
    model.load_state_dict(state)
    return model
