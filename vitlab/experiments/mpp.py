"""Masked patch prediction pre-training then fine-tuning, against scratch at equal total time.

For every budget (total minutes of wall time) and seed: a ViT pre-trained by MPP for
``pretrain_share`` of the budget and fine-tuned for the rest, against the same ViT trained
on the labels from scratch for the whole budget.  Both start from the same init
(``patch_init``) and use the same optimiser settings, so the only difference is how the
first part of the budget is spent.  The three targets of Appendix B.1.2 are compared at the
shortest budget (``all_targets=True``: at every budget); the longer budgets run the paper's
default target (3-bit mean colour).  ``targets=color`` (or ``color,pixels``...) names the
targets to run at every budget instead, so that one long budget need not train all three.
A budget of 0 is step-bounded (``steps``, the quick form).
"""
from __future__ import annotations

from vitlab.analysis.plots import plot_bars
from vitlab.config import ConfigError
from vitlab.experiments.common import train_vit, vit_overrides
from vitlab.experiments.tables import bars_of
from vitlab.models.mpp import TARGETS

TITLE = "masked patch prediction (self-supervised) pre-training vs training from scratch"
PAPER = ("Sec. 4.6: MPP pre-training of ViT-B/16 on JFT gives 79.9% ImageNet, +2% over scratch "
         "but 4% below supervised pre-training")
SUMMARY = ("budget_min", "run")
METRICS = ("val_top1", "wall_s", "steps")
QUICK = dict(steps=20, budgets=(0,), seeds=1)
# 2 seeds x (4 runs x 3 minutes + 2 runs x 9 minutes) = 60 minutes
DEFAULT = dict(img_size=32, val_split=5000, steps=100_000, batch_size=128, lr=1e-3, width=192, depth=6,
               num_heads=3, mlp_dim=384, patch_size=4, seeds=2, budgets=(3.0, 9.0), pretrain_share=0.6,
               patch_init="whiten")
# targets: the targets to run at every budget (None: as all_targets says); all_targets: all three at every budget
OPTIONS = dict(targets=None, all_targets=False)
ARMS = dict(budgets="run.time_limit")  # a budget's minutes (0: bounded by steps)
UNUSED = dict(time_limit="each run's minutes are its budget's share (--set budgets=[...], in minutes; "
                         "0: bounded by steps)")


def targets_at(settings, budget) -> tuple:
    chosen = settings.get("targets")
    if chosen is not None:
        chosen = tuple(t.strip() for t in chosen.split(",")) if isinstance(chosen, str) else tuple(chosen)
        unknown = [t for t in chosen if t not in TARGETS]
        if unknown or not chosen:
            raise ValueError(f"targets={','.join(chosen)!r}: allowed targets are {', '.join(TARGETS)}")
        return chosen
    budgets = tuple(settings.get("budgets", (0,)))
    return TARGETS if settings.get("all_targets", False) or budget == min(budgets) else ("color",)


def pretrain_steps(settings) -> int:
    """The pre-training's step ceiling, ``pretrain_share`` of ``steps``; the fine-tuning gets the rest.
    Checked before any run: a share of 1 or more, or too few steps, left the fine-tuning no steps and
    failed as ``optim.steps=0`` once the pre-training had trained."""
    share = settings.get("pretrain_share", 0.6)
    if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 < share < 1:
        raise ConfigError(f"experiment mpp: pretrain_share={share!r}: expected a number between 0 and 1 (exclusive), "
                          "the share of each budget spent on pre-training, such as 0.6")
    pre_steps = max(1, int(settings.steps * share))
    if settings.steps - pre_steps < 1:
        raise ConfigError(f"experiment mpp: steps={settings.steps}: leaves the fine-tuning no step after "
                          f"{pre_steps} of pre-training (pretrain_share={share}); expected at least 2")
    return pre_steps


def run(settings, out):
    pretrain_steps(settings)
    rows = []
    for budget in settings.get("budgets", (0,)):
        for seed in settings.new_seeds():
            rows += [mpp_then_finetune(settings, out, budget, seed, target) for target in targets_at(settings, budget)]
            rows.append(scratch(settings, out, budget, seed))
    return rows


def mpp_then_finetune(settings, out, budget, seed, target) -> dict:
    """One row: MPP pre-training for ``pretrain_share`` of the budget, then fine-tuning."""
    share = float(settings.get("pretrain_share", 0.6))
    pre_steps = pretrain_steps(settings)  # ceilings; a budget's time limit decides
    tag = f"{budget:g}min"
    pre = train_vit(settings, out / f"{tag}-mpp-{target}-s{seed}", seed, vit_overrides(settings), dict(
        _init(settings), **{"model.mpp": target, "model.mpp_rate": 0.5, "optim.steps": pre_steps,
                     "run.time_limit": budget * share}))
    ft = train_vit(settings, out / f"{tag}-finetune-{target}-s{seed}", seed, vit_overrides(settings), {
        "model.init": pre["weights"], "model.overrides": {}, "optim.steps": settings.steps - pre_steps,
        "run.time_limit": budget * (1 - share)})
    return dict(budget_min=budget, run=f"mpp:{target}+finetune", seed=seed, val_top1=ft["val_top1"],
                wall_s=pre["wall_s"] + ft["wall_s"], steps=pre["steps"] + ft["steps"])


def scratch(settings, out, budget, seed) -> dict:
    """One row: the same ViT trained on the labels for the whole budget."""
    trained = train_vit(settings, out / f"{budget:g}min-scratch-s{seed}", seed, vit_overrides(settings),
                        dict(_init(settings), **{"run.time_limit": budget}))
    return dict(budget_min=budget, run="scratch", seed=seed, val_top1=trained["val_top1"],
                wall_s=trained["wall_s"], steps=trained["steps"])


def _init(settings) -> dict:
    return {"model.patch_init": settings.get("patch_init", "lecun")}


def plot(table):
    return plot_bars(*bars_of(table, ["budget_min", "run"], "val_top1"), ylabel="val_top1",
                     title="MPP pre-training vs scratch, equal total time")
