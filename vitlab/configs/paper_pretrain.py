"""Pre-training as in the paper, Table 3 (JFT-300M and ImageNet-21k rows).

Table 3 (all: Adam beta1 0.9, beta2 0.999, batch 4096, linear warm-up 10k steps,
resolution 224):

    model               data          epochs  base lr  decay   weight decay  dropout
    ViT-B/{16,32}       JFT-300M      7       8e-4     linear  0.1           0.0
    ViT-L/32            JFT-300M      7       6e-4     linear  0.1           0.0
    ViT-L/16            JFT-300M      7/14    4e-4     linear  0.1           0.0
    ViT-H/14            JFT-300M      14      3e-4     linear  0.1           0.0
    R50x{1,2}           JFT-300M      7       1e-3     linear  0.1           0.0
    R101x1              JFT-300M      7       8e-4     linear  0.1           0.0
    R152x{1,2}          JFT-300M      7       6e-4     linear  0.1           0.0
    R50+ViT-B/{16,32}   JFT-300M      7       8e-4     linear  0.1           0.0
    R50+ViT-L/32        JFT-300M      7       2e-4     linear  0.1           0.0
    R50+ViT-L/16        JFT-300M      7/14    4e-4     linear  0.1           0.0
    ViT-B/{16,32}       ImageNet-21k  90      1e-3     linear  0.03          0.1
    ViT-L/{16,32}       ImageNet-21k  30/90   1e-3     linear  0.03          0.1

``get_config(dataset="jft")`` gives the ViT-B/16 JFT row, ``dataset="i21k"`` the
ImageNet-21k row.  ``model_name`` (what ``--model`` passes, through ``load_recipe``) picks
the model's own row: its learning rate and epochs.  Where Table 3 gives two epoch counts,
the first is the default and ``epochs=`` takes the other.  A model without a row for the
dataset (ViT-S/16, ViT-H/14 on ImageNet-21k, a BiT on ImageNet-21k, ...) takes ViT-B/16's
row, and the config's ``recipe`` says so.  Weight decay is in the paper's (and PyTorch
AdamW's) units: see vitlab/train/optim.py for how it maps onto the official code's
decoupled decay on the kernels.  The head has a pre-logits layer (dense + tanh, width D;
Sec. 3.1).  A batch of 4096 that does not fit is reached with ``--accum-steps K`` (K
micro-batches of 4096/K, the same update up to float rounding).  Clipping at global norm 1:
the caption of Table 3 states it for ImageNet; the official configs use it throughout.

Steps: epochs x images / 4096, rounded down to thousands: 7 epochs of JFT-300M's ~303M
images = ~517k steps; 90 epochs of ImageNet-21k's ~14.2M = ~312k steps (Sec. 4.1's
counts).  The official code trains with sigmoid cross-entropy on these multi-label sets
(big_vision configs); ``loss`` chooses.  Under it the head's bias starts at -ln K, as big_vision's
ImageNet-21k config starts it (``model.head_bias_init``; docs/training.md), and a multi-label
validation set is scored by precision@1 (``val_prec1``).
"""
from __future__ import annotations

from vitlab.config import ConfigError
from vitlab.models.registry import canonical_name
from vitlab.train.config import AugmentConfig, DataConfig, ModelConfig, OptimConfig, RunConfig, TrainConfig
from vitlab.train.overrides import with_changes

BATCH = 4096
DATASETS = {
    # dataset: (its name in Table 3, images (Sec. 4.1), weight decay, dropout)
    "jft": ("JFT-300M", 303_000_000, 0.1, 0.0),
    "i21k": ("ImageNet-21k", 14_200_000, 0.03, 0.1),
}
# Table 3, by registry name: (base lr, the epochs it lists; the first is the default)
TABLE_3: dict[str, dict[str, tuple[float, tuple[int, ...]]]] = {
    "jft": {
        "ViT-B/16": (8e-4, (7,)), "ViT-B/32": (8e-4, (7,)),
        "ViT-L/32": (6e-4, (7,)), "ViT-L/16": (4e-4, (7, 14)),
        "ViT-H/14": (3e-4, (14,)),
        "BiT-R50x1": (1e-3, (7,)), "BiT-R50x2": (1e-3, (7,)),
        "BiT-R101x1": (8e-4, (7,)),
        "BiT-R152x1": (6e-4, (7,)), "BiT-R152x2": (6e-4, (7,)),
        "R50x1+ViT-B/16": (8e-4, (7,)), "R50x1+ViT-B/32": (8e-4, (7,)),
        "R50x1+ViT-L/32": (2e-4, (7,)), "R50x1+ViT-L/16": (4e-4, (7, 14)),
    },
    "i21k": {
        "ViT-B/16": (1e-3, (90,)), "ViT-B/32": (1e-3, (90,)),
        "ViT-L/16": (1e-3, (30, 90)), "ViT-L/32": (1e-3, (30, 90)),
    },
}
DEFAULT_MODEL = "ViT-B/16"  # the recipe's own model, and the row of a model Table 3 has none for


def steps_for(epochs: int, images: int) -> int:
    """Optimiser steps of ``epochs`` passes over ``images`` at batch 4096, rounded down to thousands."""
    return int(epochs * images / BATCH) // 1000 * 1000


def get_config(dataset: str = "jft", model_name: str | None = None, epochs: str | int | None = None) -> TrainConfig:
    if dataset not in DATASETS:
        raise ValueError(f"dataset={dataset!r}: allowed values are {', '.join(DATASETS)}")
    data_name, images, wd, dropout = DATASETS[dataset]
    if model_name is not None and not model_name.strip():  # "model_name=" had trained the default model
        raise ValueError(f"model_name={model_name!r}: expected a registry name, e.g. ViT-L/16")
    name = canonical_name(model_name) if model_name else DEFAULT_MODEL
    row = TABLE_3[dataset].get(name)
    source = ""
    if row is None:
        row = TABLE_3[dataset][DEFAULT_MODEL]
        source = f" [Table 3 has no {name} row for {data_name}: {DEFAULT_MODEL}'s rate and epochs]"
    lr, listed = row
    if epochs is None:
        epochs = listed[0]
    elif not str(epochs).isdigit() or int(epochs) not in listed:
        raise ConfigError(f"recipe paper_pretrain: epochs={epochs}: Table 3 trains {name} on {data_name} for "
                          f"{' or '.join(map(str, listed))} epochs (--steps sets any other length)")
    epochs = int(epochs)
    cfg = TrainConfig(
        recipe=f"paper_pretrain:dataset={dataset},model_name={name},epochs={epochs}{source}",
        model=ModelConfig(name=DEFAULT_MODEL, overrides=dict(dropout=dropout), pre_logits=True, img_size=224),
        data=DataConfig(val_split=0.01),
        augment=AugmentConfig(crop="inception", crop_scale=(0.05, 1.0), flip=True),  # the official pre-training crop
        optim=OptimConfig(optimizer="adam", betas=(0.9, 0.999), lr=lr, weight_decay=wd, wd_scope="kernels",
                          batch_size=BATCH, accum_steps=1, steps=steps_for(epochs, images), warmup=10_000,
                          decay="linear", clip_norm=1.0, loss="sigmoid_xent"),
        run=RunConfig(precision="bf16", eval_every=10_000, log_every=50, ckpt_every=1000, keep_ckpts=2,
                      out="runs/paper_pretrain"),
    )
    # another model: as `--model` changes it (a ResNet leaves out the ViT's dropout and pre-logits)
    return cfg if name == DEFAULT_MODEL else with_changes(cfg, {"model.name": name})
