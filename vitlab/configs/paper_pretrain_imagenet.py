"""Training ViT on ImageNet-1k (ILSVRC-2012) alone, the last row of the paper's Table 3:

    ViT-*  ImageNet  300 epochs  base lr 3e-3  cosine decay  weight decay 0.3  dropout 0.1

with Adam (0.9, 0.999), batch 4096, 10k warm-up steps and clipping at global norm 1
("for ImageNet we found it beneficial to additionally apply gradient clipping at global
norm 1", caption of Table 3).  300 epochs of 1,281,167 images at 4096 = 93,835 steps.
The paper holds out 1% of the training set for validation (Appendix B.1).

The row is every ViT's (``ViT-*``): ``model_name`` (``--model``) changes the model, not the
rate.  Table 3 has no ImageNet row for the ResNets or the hybrids; they take the ViTs' row
(a ResNet without the ViT's dropout and pre-logits layer), and the config's ``recipe`` says so.
"""
from __future__ import annotations

from vitlab.models.registry import canonical_name
from vitlab.train.config import AugmentConfig, DataConfig, ModelConfig, OptimConfig, RunConfig, TrainConfig
from vitlab.train.overrides import with_changes

DEFAULT_MODEL = "ViT-B/16"
IMAGENET_TRAIN_IMAGES = 1_281_167
EPOCHS, BATCH = 300, 4096


def is_plain_vit(name: str) -> bool:
    """A name Table 3's ``ViT-*`` covers: ViT-Ti ... ViT-H at any patch size (not hybrids, BiT, Axial-ViT)."""
    return name.startswith("ViT-")


def get_config(model_name: str | None = None) -> TrainConfig:
    if model_name is not None and not model_name.strip():  # "model_name=" had trained the default model
        raise ValueError(f"model_name={model_name!r}: expected a registry name, e.g. ViT-L/16")
    name = canonical_name(model_name) if model_name else DEFAULT_MODEL
    source = "" if is_plain_vit(name) else f" [Table 3's ImageNet row is the ViTs' (ViT-*); {name} takes it as it is]"
    cfg = TrainConfig(
        recipe=f"paper_pretrain_imagenet:model_name={name}{source}",
        model=ModelConfig(name=DEFAULT_MODEL, overrides=dict(dropout=0.1), pre_logits=True, img_size=224),
        data=DataConfig(val_split=0.01),
        augment=AugmentConfig(crop="inception", crop_scale=(0.05, 1.0), flip=True),
        optim=OptimConfig(optimizer="adam", betas=(0.9, 0.999), lr=3e-3, weight_decay=0.3, wd_scope="kernels",
                          batch_size=BATCH, accum_steps=1, steps=EPOCHS * IMAGENET_TRAIN_IMAGES // BATCH,
                          warmup=10_000, decay="cosine", clip_norm=1.0, loss="softmax_xent"),
        run=RunConfig(precision="bf16", eval_every=5000, log_every=50, ckpt_every=1000, keep_ckpts=2,
                      out="runs/paper_pretrain_imagenet"),
    )
    return cfg if name == DEFAULT_MODEL else with_changes(cfg, {"model.name": name})
